"""The batched sampler against transformers' own logits processors, row by row."""

import torch

from server.engine.sampling import BatchSampler, Row, SamplingParams, build_logits_processors, token_seed

PARAMS = [
    SamplingParams(max_new_tokens=1),
    SamplingParams(max_new_tokens=1, repetition_penalty=1.3),
    SamplingParams(max_new_tokens=1, do_sample=True, temperature=0.7),
    SamplingParams(max_new_tokens=1, do_sample=True, top_k=5),
    SamplingParams(max_new_tokens=1, do_sample=True, top_p=0.8),
    SamplingParams(max_new_tokens=1, do_sample=True, min_p=0.1),
    SamplingParams(max_new_tokens=1, do_sample=True, temperature=1.3, top_k=40, top_p=0.9, min_p=0.02,
                   repetition_penalty=0.8),
    SamplingParams(max_new_tokens=1, temperature=0.5, top_k=1000),  # top_k over the vocabulary
    SamplingParams(max_new_tokens=1, do_sample=True, typical_p=0.6),
    SamplingParams(max_new_tokens=1, do_sample=True, temperature=0.9, top_p=0.95, typical_p=0.9),
    SamplingParams(max_new_tokens=1, logit_bias={3: 5.0, 17: -100.0, 150: 2.5}),
    SamplingParams(max_new_tokens=1, do_sample=True, repetition_penalty=1.2, logit_bias={7: -3.0}, typical_p=0.7),
]


def _rows(vocab: int) -> tuple[torch.Tensor, list[Row]]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAMS), vocab, generator=gen) * 3
    rows = [Row(p, torch.randint(0, vocab, (5 + i,), generator=gen).tolist(), i) for i, p in enumerate(PARAMS)]
    return logits, rows


def test_processed_scores_equal_transformers_processors():
    logits, rows = _rows(200)
    ours = BatchSampler._process(logits, rows)
    for i, row in enumerate(rows):
        theirs = build_logits_processors(row.params)(torch.tensor([row.tokens]), logits[i:i + 1].clone())[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(theirs)), i
        finite = torch.isfinite(theirs)
        torch.testing.assert_close(ours[i][finite], theirs[finite], msg=f"row {i}")


def test_choices_logprobs_and_replay():
    logits, rows = _rows(200)
    for i, row in enumerate(rows):
        row.params.top_logprobs = 3 if row.params.samples else 0
        row.params.seed = 100 + i
    sampler = BatchSampler()
    picks = sampler.sample(logits, rows)
    for i, (token, logprob, top) in enumerate(picks):
        # transformers' processors, then the documented draw: the inverse CDF at the uniform
        # number of a generator seeded token_seed(seed, tokens generated so far)
        row = rows[i]
        theirs = build_logits_processors(row.params)(torch.tensor([row.tokens]), logits[i:i + 1].clone())[0]
        assert torch.isfinite(theirs[token])  # never a token the processors removed
        assert abs(logprob - torch.log_softmax(logits[i], -1)[token].item()) < 1e-5
        if not row.params.samples:
            assert token == int(theirs.argmax())
        else:
            uniform = torch.rand((), generator=torch.Generator().manual_seed(token_seed(row.params.seed, i)))
            cdf = torch.softmax(theirs, -1).cumsum(-1)
            assert token == int((cdf <= uniform * cdf[-1]).sum()), i
            assert [t for t, _ in top] == torch.topk(logits[i], 3).indices.tolist()
    # the same seed and index give the same token, alone or batched differently
    alone = [sampler.sample(logits[i:i + 1], [rows[i]])[0][0] for i in reversed(range(len(rows)))]
    assert list(reversed(alone)) == [t for t, _, _ in picks]


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    row_params = SamplingParams(max_new_tokens=1, do_sample=True, seed=123)
    counts = torch.zeros(4)
    sampler = BatchSampler()
    for index in range(3000):
        token, _, _ = sampler.sample(probs.log().unsqueeze(0), [Row(row_params, [1], index)])[0]
        counts[token] += 1
    assert counts[3] == 0 and (counts / 3000 - probs).abs().max() < 0.04
    assert len({token_seed(123, i) for i in range(1000)}) == 1000


def test_presence_and_frequency_penalties_follow_openais_formula():
    """logit[t] - frequency * count[t] - presence * (count[t] > 0), counting generated tokens only,
    computed here independently, beside a row without penalties that must stay untouched."""
    vocab = 50
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=gen)
    prompt, generated = [1, 2, 2, 9], [4, 4, 4, 9, 11]
    rows = [Row(SamplingParams(max_new_tokens=1, presence_penalty=0.5, frequency_penalty=0.25), prompt + generated, 5),
            Row(SamplingParams(max_new_tokens=1, presence_penalty=-1.0), prompt + generated, 5),
            Row(SamplingParams(max_new_tokens=1), prompt + generated, 5)]
    ours = BatchSampler._process(logits, rows)
    for i, (presence, frequency) in enumerate([(0.5, 0.25), (-1.0, 0.0), (0.0, 0.0)]):
        expected = logits[i].clone()
        for t in set(generated):
            expected[t] -= frequency * generated.count(t) + presence
        torch.testing.assert_close(ours[i], expected)
    assert ours[0, 2] == logits[0, 2]  # a prompt token is not penalised


def test_a_step_reaches_the_host_in_one_copy(monkeypatch):
    """Tokens, their logprobs and the alternatives asked for come back in one ``tolist`` (on a GPU
    each is a sync; benchmarks/gpu_check.py counts the syncs themselves), each value as the model's
    own log-softmax has it."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    rows = [Row(SamplingParams(max_new_tokens=4, top_logprobs=3 if i in (1, 4) else 0), [1, 2], 0) for i in range(6)]
    copies = []
    tolist = torch.Tensor.tolist

    def counted(self):
        copies.append(tuple(self.shape))
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    out = BatchSampler().sample(logits.clone(), rows)
    monkeypatch.undo()
    assert len(copies) == 1, copies
    logprobs = torch.log_softmax(logits, -1)
    for i, (token, logprob, top) in enumerate(out):
        assert token == int(logits[i].argmax()) and logprob == float(logprobs[i, token])
        values, indices = torch.topk(logprobs[i], 3)
        assert top == (list(zip(indices.tolist(), values.tolist())) if i in (1, 4) else [])


def test_a_sampled_step_builds_its_parameters_on_the_host(monkeypatch):
    """Temperature, top-k/p, min-p, penalties, biases and the uniform draws are made from Python
    values on the host and moved by ``sampling.to_device`` (on a GPU from pinned memory, without
    the host waiting), never as ``torch.tensor(..., device=...)``: on a GPU that is a pageable copy
    and a sync each (benchmarks/gpu_check.py counts the syncs themselves)."""
    from server.engine.sampling import to_device

    params = SamplingParams(max_new_tokens=4, do_sample=True, temperature=0.8, top_k=5, top_p=0.9, min_p=0.02,
                            typical_p=0.95, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2,
                            logit_bias={3: 2.0}, seed=11)
    rows = [Row(params if i % 2 else SamplingParams(max_new_tokens=4), [1, 2, 3, 2], 2) for i in range(4)]
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    expected = BatchSampler().sample(logits.clone(), rows)
    made_on_a_device = []
    tensor = torch.tensor

    def spy(*args, **kwargs):
        if kwargs.get("device") is not None:
            made_on_a_device.append(kwargs["device"])
        return tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", spy)
    out = BatchSampler().sample(logits.clone(), rows)
    monkeypatch.undo()
    assert not made_on_a_device and out == expected
    host = torch.tensor([1, 2])
    assert to_device(host, torch.device("cpu")) is host  # nothing copied on the host
    moved = to_device([0.5, 1.5], torch.device("meta"), torch.float64)  # another device: moved, dtype kept
    assert moved.device.type == "meta" and moved.dtype == torch.float64 and moved.shape == (2,)
