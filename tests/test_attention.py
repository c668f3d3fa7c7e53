"""Per-sequence attention over the packed row gives the tokens of SDPA over the dense block-causal mask."""

import pytest
import torch

from tests.checkpoints import write_checkpoint


def _engine_tokens(path, packed: bool, calls: dict) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    import server.attention as attention
    from server.engine import NewSequence, RankEngine, StepPlan
    from server.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = RankEngine(model, torch.device("cpu"), 0)
    if not packed:
        engine.packed_attention = False
        model.config._attn_implementation = "sdpa"
    original = attention.packed_attention

    def counting(*args, hsdp_packed=None, **kwargs):
        calls["packed" if hsdp_packed is not None else "dense"] += 1
        return original(*args, hsdp_packed=hsdp_packed, **kwargs)

    gen = torch.Generator().manual_seed(0)
    new = [NewSequence(i, 0, torch.randint(3, 300, (3 + 9 * i,), generator=gen).tolist(),
                       SamplingParams(max_new_tokens=30)) for i in range(5)]
    plans = [StepPlan(add=new[:2], forward=True), StepPlan(add=new[2:4], forward=True)]  # prefill beside decode
    plans += [StepPlan(forward=True), StepPlan(remove=[1], forward=True), StepPlan(add=new[4:], forward=True)]
    plans += [StepPlan(remove=[0, 3], forward=True), StepPlan(forward=True)]
    from transformers import AttentionInterface

    AttentionInterface.register(attention.ATTN_IMPLEMENTATION, counting)
    try:
        return [[(t.seq_id, t.token_id) for t in engine.step(plan).tokens] for plan in plans]
    finally:
        AttentionInterface.register(attention.ATTN_IMPLEMENTATION, original)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # both grouped-query attention
def test_packed_attention_matches_dense_sdpa(tmp_path, arch):
    path = write_checkpoint(tmp_path / arch, arch)
    calls = {"packed": 0, "dense": 0}
    packed = _engine_tokens(path, True, calls)
    assert calls["packed"] > 0 and calls["dense"] == 0
    assert packed == _engine_tokens(path, False, calls)
    assert [len(step) for step in packed] == [2, 4, 4, 3, 4, 2, 2]


def test_layout_groups_each_sequence_in_position_order():
    from server.attention import PackedLayout

    # two sequences interleaved in the cache: seq 0 at positions 0,1,2 and seq 1 at 0,1, then
    # a new query for each (seq 1 has two: it is prefilling)
    k_seq = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 1])
    k_pos = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4])
    q_seq, q_pos = torch.tensor([0, 1, 1]), torch.tensor([3, 3, 4])
    layout = PackedLayout(q_seq, q_pos, k_seq, k_pos)
    decoding, prefilling = layout.groups  # seq 0 decodes, seq 1 prefills: one group each
    assert decoding.k_index_SL.tolist() == [[0, 2, 4, 6]] and decoding.q_index_SQ.tolist() == [[0]]
    assert prefilling.k_index_SL.tolist() == [[1, 3, 5, 7, 8]] and prefilling.q_index_SQ.tolist() == [[1, 2]]
    assert decoding.allowed_S1QL[:, 0].tolist() == [[[True, True, True, True]]]
    assert prefilling.allowed_S1QL[:, 0].tolist() == [[[True, True, True, True, False], [True] * 5]]  # causal


def test_layout_pads_sequences_of_one_group():
    from server.attention import PackedLayout

    # three decoding sequences of 3, 1 and 2 keys (the query's own included)
    k_seq, k_pos = torch.tensor([0, 0, 2, 1, 2, 0]), torch.tensor([0, 1, 0, 0, 1, 2])
    layout = PackedLayout(torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1]), k_seq, k_pos)
    (group,) = layout.groups
    assert group.k_index_SL.tolist() == [[0, 1, 5], [3, 0, 0], [2, 4, 0]]
    assert group.allowed_S1QL[:, 0, 0].tolist() == [[True, True, True], [True, False, False],
                                                    [True, True, False]]
