"""Tiny models whose memory can be counted by hand, and workload functions for SPEC tests."""

from __future__ import annotations

import torch
from torch import nn

F32 = 4  # bytes per float32 element


def mlp(d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> nn.Sequential:
    """Linear -> ReLU -> Linear: parameters (d_in+1)*d_hidden + (d_hidden+1)*d_out floats."""
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class MSEModel(nn.Module):
    """An MLP that returns its MSE loss, so it can be a workload (``output.loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


# ---- module:function workloads (named by tests as "tests.models:<name>") ----------------
def mlp_workload(batch_size: int, seq_len: int):
    """A good workload: (model, batch dict); the model returns a scalar loss."""
    return MSEModel(), {"x": torch.randn(batch_size, 16), "y": torch.randn(batch_size, 8)}


def conv_workload(batch_size: int, seq_len: int):
    """A small CNN classifier taking a tensor batch; returns a scalar loss."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.Conv2d(8, 8, 3, padding=1),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(8, 4),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x).logsumexp(-1).mean()

    return Net(), torch.randn(batch_size, 3, seq_len, seq_len)


def returns_model_only(batch_size: int, seq_len: int):
    return MSEModel()


def returns_bad_batch(batch_size: int, seq_len: int):
    return MSEModel(), 42


def no_loss_workload(batch_size: int, seq_len: int):
    return mlp(), torch.randn(batch_size, 16)


def broken_forward_workload(batch_size: int, seq_len: int):
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("custom failure inside Broken.forward")

    return Broken(), torch.randn(batch_size, 4)


class Gated(nn.Module):
    """Keeps only the positive activations: an output shape that depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[torch.nonzero(h > 0, as_tuple=True)].sum()


def data_dependent_workload(batch_size: int, seq_len: int):
    model = nn.Sequential()
    model.add_module("gate", Gated())
    return model, torch.randn(batch_size, 8)


def value_read_in_constructor_workload(batch_size: int, seq_len: int):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # A schedule read from a tensor's values while building (as ConvNeXt reads its
            # drop-path rates): the value of a computed tensor.
            rates = torch.randn(4).abs().cumsum(0).tolist()
            self.lin = nn.Linear(4, 4)
            self.rates = rates

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    return Net(), torch.randn(batch_size, 4)


class ReadsValue(nn.Module):
    """Branches in Python on a value computed from activations."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.sum() if h.mean().item() > 0 else -h.sum()


def value_read_workload(batch_size: int, seq_len: int):
    model = nn.Sequential()
    model.add_module("reader", ReadsValue())
    return model, torch.randn(batch_size, 8)


def constant_schedule_workload(batch_size: int, seq_len: int):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # Drop-path rates from constants, as ConvNeXt and Swin build theirs.
            self.rates = [r.item() for r in torch.linspace(0, 0.1, 3)]
            self.widths = torch.tensor([8, 16, 8]).tolist()
            self.lins = nn.ModuleList(
                nn.Linear(a, b) for a, b in zip(self.widths, self.widths[1:], strict=False)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for lin in self.lins:
                x = lin(x)
            # A data-dependent shape computed from constants: its real size.
            keep = torch.arange(8)[torch.arange(8) % 2 == 0]
            return x[:, keep].sum()

    return Net(), torch.randn(batch_size, 8)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    """In-projection, repeated blocks (what FSDP2 shards one by one), head; returns its loss.
    Widths are odd so that shards are uneven."""

    def __init__(self, d_in: int = 12, width: int = 33, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.head(h), y)


def stack_workload(batch_size: int, seq_len: int):
    """A :class:`Stack` (``seq_len`` is its width) and a regression batch."""
    g = torch.Generator().manual_seed(1)
    model = Stack(width=seq_len, depth=4)
    return model, {"x": torch.randn(batch_size, 12, generator=g), "y": torch.randn(batch_size, 5, generator=g)}


# ---- saved models (a Hugging Face model folder, as save_pretrained writes it) -------------
#: The words the tiny tokenizer knows, after its four specials (<pad> <s> </s> <unk>).
TINY_WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat", "sat", "on",
    "mat", "and", "ran", "far", "away",
]  # fmt: skip


def save_tiny_llama(
    folder, *, shard: bool = False, tokenizer: bool = True, tie: bool = True, seed: int = 0
):
    """Save a 2-layer Llama (vocabulary 64, 64 wide, random weights from ``seed``) with
    ``save_pretrained`` into ``folder``: safetensors, in 100 KB shards with ``shard``, and a
    word-level tokenizer over :data:`TINY_WORDS` with ``tokenizer``. Returns the model."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(
        folder, safe_serialization=True, **({"max_shard_size": "100KB"} if shard else {})
    )
    if tokenizer:
        vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
        vocab.update({w: i + 4 for i, w in enumerate(TINY_WORDS)})
        inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        inner.pre_tokenizer = pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
            unk_token="<unk>",
        ).save_pretrained(folder)
    return model
