"""Random routed-expert inputs shared by the MoE kernel tests (imported by file name: this
folder is on sys.path while its tests run)."""
import torch


def random_experts(T: int, k: int, E: int, h: int, i: int, limit: float, seed: int = 0,
                   same_experts: bool = False) -> tuple[torch.Tensor, ...]:
    """fp32 on the CPU: x [T, h], routing weights [T, k], ids [T, k] (distinct within a token;
    the same k experts for every token when same_experts), w1/w3 [E, i, h] scaled so |gate| and
    |up| often exceed `limit`, w2 [E, h, i] -> (x, weights, ids, w1, w2, w3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=g)
    if same_experts:
        ids = torch.randperm(E, generator=g)[:k].repeat(T, 1)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
            torch.zeros(0, k, dtype=torch.long)
    weights = torch.rand(T, k, generator=g) * 2.5
    w1 = torch.randn(E, i, h, generator=g) * (3 * limit / h ** 0.5)  # gate std ~ 3 limit
    w3 = torch.randn(E, i, h, generator=g) * (1.5 * limit / h ** 0.5)
    w2 = torch.randn(E, h, i, generator=g) / i ** 0.5
    return x, weights, ids, w1, w2, w3
