"""A Llama with an fp32 island, a packed int8 parameter and a 0-dim parameter inside a decoder layer."""

import torch
from torch import nn
from transformers import LlamaForCausalLM


class Fp32Island(nn.Module):
    """Scales hidden states in fp32 whatever the model's dtype, as norm/router modules often do."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.scale = nn.Parameter(torch.tensor(1.0, dtype=torch.float32))  # 0-dim
        self.packed = nn.Parameter(torch.zeros(hidden_size // 2, dtype=torch.int8), requires_grad=False)

    def forward(self, x):
        offsets = self.packed.to(torch.float32).repeat_interleave(2) / 64.0
        return (x.float() * self.weight * self.scale + offsets).to(x.dtype)


class MlpWithIsland(nn.Module):
    def __init__(self, mlp: nn.Module, hidden_size: int):
        super().__init__()
        self.inner = mlp
        self.island = Fp32Island(hidden_size)

    def forward(self, x):
        return self.island(self.inner(x))


class IslandLlama(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        layer = self.model.layers[1]
        layer.mlp = MlpWithIsland(layer.mlp, config.hidden_size)


def randomize_island(model: IslandLlama, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    island = model.model.layers[1].mlp.island
    with torch.no_grad():
        island.weight.copy_(1 + 0.1 * torch.randn(island.weight.shape, generator=g))
        island.scale.fill_(0.9)
        island.packed.copy_(torch.randint(-8, 8, island.packed.shape, generator=g, dtype=torch.int8))
