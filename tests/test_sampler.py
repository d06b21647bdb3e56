"""The batched sampler: each parameter's semantics, their order, and seeded determinism."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from llmkube.serving.engine import sampler as sampler_module
from llmkube.serving.engine.sampler import (
    Sampler,
    apply_penalties,
    prompt_logprobs,
)
from llmkube.serving.engine.sampling_params import SamplingParams

V = 1000
EOS = 7


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    grammar: Any = None


class AllowOnly:
    """A stand-in GrammarState that allows a fixed set of tokens."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        bitmask[row].zero_()
        for t in self.allowed:
            word, bit = divmod(t, 32)
            bitmask[row, word] |= -(1 << 31) if bit == 31 else 1 << bit
        return True


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=seeded(seed)) * 3


def run(logits: torch.Tensor, rows: list[Row], eos: frozenset[int] = frozenset({EOS})):
    return Sampler(logits.shape[1], eos)(logits.clone(), rows)


# --------------------------------------------------------------------------- greedy and logprobs


def test_greedy_is_argmax_and_no_logprobs_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = randn(16, V)

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("log_softmax must not run when no row wants logprobs")

    monkeypatch.setattr(torch, "log_softmax", forbidden)
    out = run(logits, [Row(SamplingParams(temperature=0.0)) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_logprobs_are_raw_log_softmax_with_top_k_and_rank() -> None:
    logits = randn(4, V, seed=1)
    raw = torch.log_softmax(logits, -1)
    forced = int(logits[1].argsort()[V // 2])  # a middling token, forced by logit_bias
    rows = [
        Row(SamplingParams(temperature=0.0, logprobs=5)),
        Row(SamplingParams(temperature=0.0, logprobs=3, logit_bias={forced: 100.0})),
        Row(SamplingParams(temperature=0.0)),
        Row(SamplingParams(temperature=1.0, logprobs=0, seed=3), generator=seeded(3)),
    ]
    out = run(logits, rows)
    greedy = out.logprobs[0]
    assert greedy is not None and greedy.token_id == out.token_ids[0] == int(logits[0].argmax())
    assert greedy.logprob == raw[0, greedy.token_id].item()  # exactly
    assert greedy.rank == 1
    top_ids = raw[0].topk(5).indices.tolist()
    assert [t for t, _ in greedy.top] == top_ids
    for (_, lp), expected in zip(greedy.top, raw[0, top_ids].tolist(), strict=True):
        assert lp == pytest.approx(expected, abs=1e-6)
    assert [lp for _, lp in greedy.top] == sorted((lp for _, lp in greedy.top), reverse=True)

    biased = out.logprobs[1]
    assert out.token_ids[1] == forced and biased is not None
    # The logprob and rank describe the raw distribution, not the biased one.
    assert biased.logprob == pytest.approx(raw[1, forced].item(), abs=1e-6)
    assert biased.rank == 1 + int((raw[1] > raw[1, forced]).sum())
    assert biased.rank > 400
    assert len(biased.top) == 3 and biased.top[0][0] == int(logits[1].argmax())

    assert out.logprobs[2] is None
    sampled = out.logprobs[3]
    assert sampled is not None and sampled.top == []
    assert sampled.logprob == pytest.approx(raw[3, out.token_ids[3]].item(), abs=1e-6)
    assert sampled.rank == 1 + int((raw[3] > raw[3, out.token_ids[3]]).sum())


def test_prompt_logprobs_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = randn(9, V, seed=2)
    targets = [5, 999, 0, 42, 42, 17, 3, 8, 600]
    monkeypatch.setattr(sampler_module, "_PROMPT_LOGPROBS_CHUNK_ELEMENTS", 2 * V)  # chunks of 2 rows
    result = prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, -1)
    assert [r.token_id for r in result] == targets
    for t, (r, target) in enumerate(zip(result, targets, strict=True)):
        assert r.logprob == pytest.approx(raw[t, target].item(), abs=1e-6)
        assert r.rank == 1 + int((raw[t] > raw[t, target]).sum())
        assert [i for i, _ in r.top] == raw[t].topk(2).indices.tolist()
    with pytest.raises(ValueError):
        prompt_logprobs(logits, targets[:3], 2)


# --------------------------------------------------------------------------- logits processing


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = randn(3, V, seed=3)
    best = int(logits[1].argmax())
    rows = [
        Row(SamplingParams(temperature=0.0, logit_bias={123: 100.0})),
        Row(SamplingParams(temperature=0.0, logit_bias={best: -100.0})),
        Row(SamplingParams(temperature=1.0, logit_bias={"456": 100.0}), generator=seeded(0)),  # type: ignore[dict-item]
    ]
    out = run(logits, rows)
    assert out.token_ids[0] == 123
    assert out.token_ids[1] != best and out.token_ids[1] == int(logits[1].topk(2).indices[1])
    assert out.token_ids[2] == 456


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached() -> None:
    logits = randn(3, V, seed=4)
    logits[:, EOS] = 50.0
    logits[:, 11] = 40.0
    logits[:, 12] = 30.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[11])
    rows = [
        Row(params, output_token_ids=[]),
        Row(params, output_token_ids=[5, 5]),
        Row(params, output_token_ids=[5, 5, 5]),
    ]
    out = run(logits, rows)
    assert out.token_ids == [12, 12, EOS]
    many = logits[:1].expand(50, -1).clone()
    sampled = run(many, [Row(SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[11]))] * 50)
    assert not {EOS, 11} & set(sampled.token_ids)


def reference_penalties(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The formulas, one token at a time."""
    out = logits.clone()
    for i, row in enumerate(rows):
        p = row.params
        for t in set(row.prompt_token_ids) | set(row.output_token_ids):
            x = out[i, t].item()
            out[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(row.output_token_ids):
            count = row.output_token_ids.count(t)
            out[i, t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_follow_the_formulas_exactly() -> None:
    logits = randn(4, V, seed=5)
    rows = [
        Row(SamplingParams(repetition_penalty=1.3), prompt_token_ids=[1, 2, 2, 900], output_token_ids=[3, 3, 5]),
        Row(SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), output_token_ids=[9, 9, 9, 10]),
        Row(SamplingParams(), output_token_ids=[1, 2, 3]),  # no penalties: untouched
        Row(SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0),
            prompt_token_ids=[4, 500], output_token_ids=[500, 6, 6]),
    ]
    # Both signs of logits must be exercised on penalised tokens.
    logits[0, 1], logits[0, 3] = 2.0, -2.0
    expected = reference_penalties(logits, rows)
    actual = logits.clone()
    apply_penalties(actual, rows)
    assert torch.allclose(actual, expected, atol=1e-6)
    assert torch.equal(actual[2], logits[2])
    assert actual[0, 1].item() == pytest.approx(2.0 / 1.3)
    assert actual[0, 3].item() == pytest.approx(-2.6)
    assert actual[1, 9].item() == pytest.approx(logits[1, 9].item() - 3 * 0.7 + 0.4)


def test_penalties_flip_the_greedy_choice() -> None:
    logits = torch.zeros(2, V)
    logits[:, 40], logits[:, 41] = 5.0, 4.0
    rows = [
        Row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt_token_ids=[40]),
        Row(SamplingParams(temperature=0.0, frequency_penalty=0.6), output_token_ids=[40, 40]),
    ]
    assert run(logits, rows).token_ids == [41, 41]
    rows[1].output_token_ids = [40]
    assert run(logits, rows).token_ids[1] == 40


# --------------------------------------------------------------------------- filters


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = randn(64, V, seed=6)
    greedy = logits.argmax(-1).tolist()
    assert run(logits, [Row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(64)]).token_ids == greedy
    assert run(logits, [Row(SamplingParams(temperature=1.5, top_p=1e-6)) for _ in range(64)]).token_ids == greedy
    # 1 - 1e-9 rounds to 1.0 in float32: the best token must survive anyway
    assert run(logits, [Row(SamplingParams(temperature=1.5, top_p=1e-9)) for _ in range(64)]).token_ids == greedy
    mixed = [Row(SamplingParams(temperature=1.0, top_k=1 if i % 2 else 0, top_p=1e-6 if i % 2 == 0 else 1.0))
             for i in range(64)]
    assert run(logits, mixed).token_ids == greedy


def test_top_k_alone_does_not_sort_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("top_k alone must not sort")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    logits = randn(8, V, seed=7)
    out = run(logits, [Row(SamplingParams(temperature=1.0, top_k=3 if i < 4 else 0)) for i in range(8)])
    for i in range(4):
        assert out.token_ids[i] in logits[i].topk(3).indices.tolist()


def reference_kept(row: torch.Tensor, k: int, p: float) -> set[int]:
    """top_k, then the smallest best-first set whose mass reaches p, by a full sort."""
    order = row.argsort(descending=True)
    if k:
        order = order[:k]
    probs = torch.softmax(row[order].double(), -1)
    before = probs.cumsum(-1) - probs
    keep = (before < p) | (p >= 1.0)
    keep[0] = True
    return set(order[keep].tolist())


def test_top_k_top_p_filter_matches_a_full_sort_reference() -> None:
    vocab = 8192  # large enough for the candidate shortcut (it looks at the best 256 first)
    settings = [(0, 0.5), (0, 0.9), (5, 0.9), (300, 1.0), (300, 0.95), (0, 0.99), (40, 0.0001), (0, 1.0)]
    rows = []
    for scale in (8.0, 0.05):  # peaked rows are decided among the candidates, flat ones need the sort
        rows += [(scale, k, p) for k, p in settings]
    logits = torch.stack([torch.randn(vocab, generator=seeded(20 + i)) * scale
                          for i, (scale, _, _) in enumerate(rows)])
    filtered = logits.clone()
    sampler_module._top_k_top_p(filtered, [k for _, k, _ in rows], [p for _, _, p in rows])
    for i, (_, k, p) in enumerate(rows):
        kept = set(torch.nonzero(~torch.isneginf(filtered[i])).flatten().tolist())
        assert kept == reference_kept(logits[i], k, p), (i, k, p)
        assert torch.equal(filtered[i, sorted(kept)], logits[i, sorted(kept)])
    # the flat rows with p < 1 and no top_k really needed the fallback sort
    assert len(reference_kept(logits[len(settings) + 1], 0, 0.9)) > 256


def chi_square(token_ids: list[int], expected: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(token_ids), minlength=expected.numel()).double()
    exp = expected.double() * len(token_ids)
    support = exp > 0
    assert observed[~support].sum() == 0, "sampled a token outside the support"
    return float(((observed[support] - exp[support]) ** 2 / exp[support]).sum())


N = 20000
SMALL = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])


def sample_many(params: SamplingParams, logits: torch.Tensor = SMALL) -> list[int]:
    torch.manual_seed(1234)  # unseeded rows use the global generator: keep the test deterministic
    return run(logits.expand(N, -1).clone(), [Row(params) for _ in range(N)], eos=frozenset()).token_ids


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_matches_softmax_of_scaled_logits(temperature: float) -> None:
    expected = torch.softmax(SMALL / temperature, -1)
    # df = 5; P(chi2 > 30) ~ 1.5e-5
    assert chi_square(sample_many(SamplingParams(temperature=temperature)), expected) < 30


def test_top_k_top_p_min_p_renormalise_the_kept_tokens() -> None:
    probs = torch.softmax(SMALL, -1)  # ~ [.48, .29, .18, .06, .02, .00]

    def kept(mask: list[bool]) -> torch.Tensor:
        p = probs * torch.tensor(mask)
        return p / p.sum()

    assert chi_square(sample_many(SamplingParams(top_k=2)), kept([1, 1, 0, 0, 0, 0])) < 30
    # smallest set with mass >= 0.7 is {0, 1}
    assert chi_square(sample_many(SamplingParams(top_p=0.7)), kept([1, 1, 0, 0, 0, 0])) < 30
    assert chi_square(sample_many(SamplingParams(top_p=0.8)), kept([1, 1, 1, 0, 0, 0])) < 30
    # min_p keeps tokens with prob >= 0.3 * max = 0.145
    assert chi_square(sample_many(SamplingParams(min_p=0.3)), kept([1, 1, 1, 0, 0, 0])) < 30
    # combined: top_k=3, then top_p=0.6 over the renormalised three (~[.51, .31, .19]) -> {0, 1}
    assert chi_square(sample_many(SamplingParams(top_k=3, top_p=0.6)), kept([1, 1, 0, 0, 0, 0])) < 30
    # min_p applies after temperature: at T=2 the distribution flattens and keeps more tokens
    flat = torch.softmax(SMALL / 2, -1)
    flat_kept = flat * (flat >= 0.3 * flat.max())
    assert chi_square(sample_many(SamplingParams(temperature=2.0, min_p=0.3)), flat_kept / flat_kept.sum()) < 30


# --------------------------------------------------------------------------- randomness


def test_seeded_rows_ignore_batch_companions_and_position() -> None:
    steps = [randn(1, V, seed=100 + s) for s in range(10)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def alone() -> list[int]:
        row = Row(params, generator=seeded(42))
        return [run(step, [row]).token_ids[0] for step in steps]

    def in_batch(position: int) -> list[int]:
        row = Row(params, generator=seeded(42))
        tokens = []
        for s, step in enumerate(steps):
            companions = [
                Row(SamplingParams(temperature=0.8, top_k=5)),
                Row(SamplingParams(temperature=1.2, seed=7), generator=seeded(7 + s)),
                Row(SamplingParams(temperature=0.0)),
                Row(SamplingParams(temperature=1.0, min_p=0.1, logprobs=2)),
            ]
            rows = [*companions[:position], row, *companions[position:]]
            logits = randn(5, V, seed=500 + s)
            logits[position] = step[0]
            tokens.append(run(logits, rows).token_ids[position])
        return tokens

    reference = alone()
    assert reference == alone()
    assert in_batch(0) == reference
    assert in_batch(3) == reference
    other_seed = [run(step, [Row(params, generator=seeded(43))]).token_ids[0] for step in steps]
    assert other_seed != reference


def test_unseeded_rows_vary() -> None:
    logits = torch.zeros(200, V)
    tokens = run(logits, [Row(SamplingParams(temperature=1.0)) for _ in range(200)]).token_ids
    assert len(set(tokens)) > 150
    again = run(logits, [Row(SamplingParams(temperature=1.0)) for _ in range(200)]).token_ids
    assert again != tokens


# --------------------------------------------------------------------------- everything at once


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_mixing_every_feature(device: str) -> None:
    logits = randn(8, V, seed=9)
    logits[[0, 3, 6], EOS] = 30.0  # EOS would win unless blocked
    logits[4, EOS] = 12.0  # wins unless penalised
    top4 = int(logits[4].topk(2).indices[1])  # the best non-EOS token of row 4
    allowed = {5, 17, 33, 900}
    rows = [
        Row(SamplingParams(temperature=0.0, logprobs=3)),
        Row(SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=11), generator=seeded(11)),
        Row(SamplingParams(temperature=0.0, logit_bias={321: 100.0})),
        Row(SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[8], logprobs=1), output_token_ids=[4]),
        Row(SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=2.0),
            prompt_token_ids=[EOS], output_token_ids=[top4]),
        Row(SamplingParams(temperature=0.9), grammar=AllowOnly(allowed)),
        Row(SamplingParams(temperature=0.0, min_tokens=5), grammar=AllowOnly({EOS})),  # grammar beats min_tokens
        Row(SamplingParams(temperature=1.3, top_k=1, min_tokens=1), grammar=AllowOnly(allowed)),
    ]
    out = run(logits.to(device), rows)
    assert out.token_ids[0] == EOS
    assert out.logprobs[0] is not None and out.logprobs[0].rank == 1 and len(out.logprobs[0].top) == 3
    alone = run(logits[1:2].to(device), [Row(rows[1].params, generator=seeded(11))]).token_ids[0]
    assert out.token_ids[1] == alone
    assert out.token_ids[1] in logits[1].topk(50).indices.tolist()
    assert out.token_ids[2] == 321
    assert out.token_ids[3] not in (EOS, 8) and out.logprobs[3] is not None
    assert out.logprobs[3].logprob == pytest.approx(torch.log_softmax(logits[3], -1)[out.token_ids[3]].item(),
                                                    abs=1e-6)
    penalised = reference_penalties(logits[4:5], [rows[4]])[0]
    assert out.token_ids[4] == int(penalised.argmax()) not in (EOS, top4)
    assert out.token_ids[5] in allowed
    assert out.token_ids[6] == EOS
    assert out.token_ids[7] == max(allowed, key=lambda t: logits[7, t].item())
    assert [lp is None for lp in out.logprobs] == [False, True, True, False, True, True, True, True]


def test_rejects_mismatched_shapes_and_accepts_half_precision() -> None:
    sampler = Sampler(V, frozenset({EOS}))
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, V), [Row(SamplingParams())])
    with pytest.raises(ValueError):
        sampler(torch.zeros(1, V + 1), [Row(SamplingParams())])
    assert sampler(torch.zeros(0, V), []).token_ids == []
    logits = randn(2, V, seed=10)
    out = sampler(logits.bfloat16(), [Row(SamplingParams(temperature=0.0, logprobs=1))] * 2)
    assert out.token_ids == logits.bfloat16().float().argmax(-1).tolist()
