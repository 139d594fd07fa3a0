"""transformers engine and adapter on a real tiny Qwen2: logprob semantics, EOS handling, weights."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from knittrans.errors import InvalidRequest
from knittrans.rollout.engines import HFEngine, HFEngineConfig, RolloutEngine
from knittrans.rollout.generated import GeneratedGroup, PromptRequest, to_trajectory_group
from knittrans.rollout.models import build_tiny_qwen2
from knittrans.schema import Media, build_unit_tables

VOCAB = 256
EOS = VOCAB - 1
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42]]  # different lengths: left padding is exercised
# Peaky random policy (init std 0.3): temperature changes logprobs by far more than the tolerance.
INIT_STD = 0.3
ATOL = 2e-4  # float32; batched + left-padded generation vs an unpadded single-sequence forward


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny Qwen2 policies with different weights (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("tiny-qwen2")
    return (
        build_tiny_qwen2(root / "a", vocab_size=VOCAB, seed=0, init_std=INIT_STD),
        build_tiny_qwen2(root / "b", vocab_size=VOCAB, seed=1, init_std=INIT_STD),
    )


@pytest.fixture(scope="module")
def engine(model_dirs: tuple[Path, Path]) -> HFEngine:
    """HFEngine on policy a (module-scoped; tests that load other weights use their own engine)."""
    return HFEngine(model_dirs[0])


@functools.cache
def reference_model(model_dir: Path) -> torch.nn.Module:
    """The policy loaded independently of the engine, for reference forward passes."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def forward_logprobs(model_dir: Path, prompt: np.ndarray, response: np.ndarray, temperature: float) -> np.ndarray:
    """Reference: log_softmax(logits / T) of each response token from one unpadded forward pass."""
    model = reference_model(model_dir)
    ids = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, prompt.shape[0] - 1 : -1].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, ids[0, prompt.shape[0] :, None]).squeeze(1).numpy()


def check_group_shape(group: GeneratedGroup, n: int, max_new_tokens: int) -> None:
    """Invariants every group must satisfy: n samples, EOS only last, lengths and dtypes."""
    assert group.n == n
    for s in group.samples:
        assert s.response_ids.dtype == np.int32 and s.response_logprobs.dtype == np.float32
        assert 1 <= s.num_tokens <= max_new_tokens
        assert s.response_logprobs.shape == s.response_ids.shape
        assert np.isfinite(s.response_logprobs).all() and (s.response_logprobs <= 0).all()
        eos_at = np.flatnonzero(s.response_ids == EOS)
        if s.finish_reason == "stop":
            assert eos_at.tolist() == [s.num_tokens - 1]
        else:
            assert eos_at.size == 0 and s.num_tokens == max_new_tokens


def test_engine_satisfies_protocol(engine: HFEngine) -> None:
    """HFEngine is a RolloutEngine."""
    assert isinstance(engine, RolloutEngine)


def test_logprobs_are_those_of_the_tempered_sampling_distribution(
    engine: HFEngine, model_dirs: tuple[Path, Path]
) -> None:
    """Adapter logprobs == log_softmax(logits/T) of a fresh forward pass, and != the T=1 ones."""
    temperature = 0.7
    groups = engine.generate(PROMPTS, n=3, max_new_tokens=12, temperature=temperature, seed=3)
    assert [g.prompt_ids.tolist() for g in groups] == PROMPTS
    worst_t1 = 0.0
    for g in groups:
        check_group_shape(g, 3, 12)
        for s in g.samples:
            want = forward_logprobs(model_dirs[0], g.prompt_ids, s.response_ids, temperature)
            np.testing.assert_allclose(s.response_logprobs, want, atol=ATOL, rtol=0)
            t1 = forward_logprobs(model_dirs[0], g.prompt_ids, s.response_ids, 1.0)
            worst_t1 = max(worst_t1, float(np.abs(s.response_logprobs - t1).max()))
    assert worst_t1 > 100 * ATOL, "temperature must visibly change the logprobs, else the test proves nothing"


def test_raw_mode_gives_temperature_one_logprobs(model_dirs: tuple[Path, Path]) -> None:
    """logprobs_mode='raw' reports log_softmax(logits) even when sampling at T=1.5."""
    raw = HFEngine(model_dirs[0], HFEngineConfig(logprobs_mode="raw"))
    (g,) = raw.generate([PROMPTS[1]], n=2, max_new_tokens=8, temperature=1.5, seed=0)
    for s in g.samples:
        want = forward_logprobs(model_dirs[0], g.prompt_ids, s.response_ids, 1.0)
        np.testing.assert_allclose(s.response_logprobs, want, atol=ATOL, rtol=0)


def test_eos_ends_a_sample_and_padding_is_stripped(engine: HFEngine, model_dirs: tuple[Path, Path]) -> None:
    """A sample that draws EOS keeps it as its last token, loses the pad after it, and its
    logprobs still match the forward pass; others run to max_new_tokens."""
    for seed in range(20):
        groups = engine.generate(PROMPTS, n=8, max_new_tokens=40, temperature=1.3, seed=seed)
        reasons = {s.finish_reason for g in groups for s in g.samples}
        if reasons == {"stop", "length"}:
            break
    else:
        pytest.fail("no seed in 0..19 produced both EOS-terminated and length-capped samples")
    for g in groups:
        check_group_shape(g, 8, 40)
        for s in g.samples:
            if s.finish_reason == "stop":
                want = forward_logprobs(model_dirs[0], g.prompt_ids, s.response_ids, 1.3)
                np.testing.assert_allclose(s.response_logprobs, want, atol=ATOL, rtol=0)


def test_same_seed_same_samples_other_seed_other_samples(engine: HFEngine) -> None:
    """Generation is a function of the seed and does not touch the global torch RNG."""
    state = torch.random.get_rng_state()
    a = engine.generate(PROMPTS[:2], n=2, max_new_tokens=6, temperature=1.0, seed=11)
    b = engine.generate(PROMPTS[:2], n=2, max_new_tokens=6, temperature=1.0, seed=11)
    c = engine.generate(PROMPTS[:2], n=2, max_new_tokens=6, temperature=1.0, seed=12)
    assert torch.equal(state, torch.random.get_rng_state())
    ids = [[s.response_ids.tolist() for s in g.samples] for g in a]
    assert ids == [[s.response_ids.tolist() for s in g.samples] for g in b]
    assert ids != [[s.response_ids.tolist() for s in g.samples] for g in c]


def test_chunked_batches_equal_one_batch(model_dirs: tuple[Path, Path]) -> None:
    """Greedy output does not depend on how prompts are chunked into generate() calls."""
    one = HFEngine(model_dirs[0]).generate(PROMPTS, n=2, max_new_tokens=6, temperature=0.0, seed=0)
    chunked = HFEngine(model_dirs[0], HFEngineConfig(max_batch_rows=2)).generate(
        PROMPTS, n=2, max_new_tokens=6, temperature=0.0, seed=0
    )
    for g1, g2 in zip(one, chunked, strict=True):
        for s1, s2 in zip(g1.samples, g2.samples, strict=True):
            assert s1.response_ids.tolist() == s2.response_ids.tolist()
            np.testing.assert_allclose(s1.response_logprobs, s2.response_logprobs, atol=ATOL)


def test_greedy_takes_argmax_and_reports_temperature_one_logprobs(
    engine: HFEngine, model_dirs: tuple[Path, Path]
) -> None:
    """temperature=0 decodes greedily; logprobs are of the T=1 distribution."""
    (g,) = engine.generate([PROMPTS[0]], n=2, max_new_tokens=8, temperature=0.0, seed=0)
    a, b = g.samples
    assert a.response_ids.tolist() == b.response_ids.tolist()
    want = forward_logprobs(model_dirs[0], g.prompt_ids, a.response_ids, 1.0)
    np.testing.assert_allclose(a.response_logprobs, want, atol=ATOL, rtol=0)
    model = reference_model(model_dirs[0])
    ids = torch.from_numpy(np.concatenate([g.prompt_ids, a.response_ids]).astype(np.int64))[None]
    with torch.no_grad():
        argmax = model(input_ids=ids).logits[0, g.prompt_ids.shape[0] - 1 : -1].argmax(-1)
    assert argmax.tolist() == a.response_ids.tolist()


def test_load_weights_switches_the_policy(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """After load_weights(b.safetensors) logprobs follow policy b, not a."""
    eng = HFEngine(model_dirs[0])
    before = eng.generate([PROMPTS[1]], n=2, max_new_tokens=8, temperature=1.0, seed=5)[0]
    eng.load_weights(model_dirs[1] / "model.safetensors")
    after = eng.generate([PROMPTS[1]], n=2, max_new_tokens=8, temperature=1.0, seed=5)[0]
    for s in after.samples:
        want_b = forward_logprobs(model_dirs[1], after.prompt_ids, s.response_ids, 1.0)
        np.testing.assert_allclose(s.response_logprobs, want_b, atol=ATOL, rtol=0)
    assert before.samples[0].response_ids.tolist() != after.samples[0].response_ids.tolist() or not np.allclose(
        before.samples[0].response_logprobs, after.samples[0].response_logprobs, atol=1e-3
    )


def test_load_weights_rejects_bad_files(engine: HFEngine, tmp_path: Path) -> None:
    """Missing files, wrong names and wrong shapes are InvalidRequest naming the problem."""
    with pytest.raises(InvalidRequest, match="does not exist"):
        engine.load_weights(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    save_file({"not.a.weight": torch.zeros(2)}, str(bad))
    with pytest.raises(InvalidRequest, match=r"unexpected \['not.a.weight'\]"):
        engine.load_weights(bad)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    state["lm_head.weight"] = torch.zeros(3, 3)
    save_file(state, str(bad))
    with pytest.raises(InvalidRequest, match=r"lm_head\.weight has shape"):
        engine.load_weights(bad)


def test_bad_sampling_arguments_and_prompts_are_rejected(engine: HFEngine) -> None:
    """n, max_new_tokens, temperature and empty or non-integer prompts are checked up front."""
    with pytest.raises(InvalidRequest, match="n must be positive"):
        engine.generate(PROMPTS, n=0, max_new_tokens=4, temperature=1.0, seed=0)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        engine.generate(PROMPTS, n=1, max_new_tokens=0, temperature=1.0, seed=0)
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.generate(PROMPTS, n=1, max_new_tokens=4, temperature=-1.0, seed=0)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate([[]], n=1, max_new_tokens=4, temperature=1.0, seed=0)
    with pytest.raises(InvalidRequest, match="integer"):
        engine.generate([[0.5, 1.5]], n=1, max_new_tokens=4, temperature=1.0, seed=0)


def test_media_ride_along_into_unit_tables(engine: HFEngine) -> None:
    """Prompt media reach the group unchanged and become the group's shared media in the unit."""
    image = Media(kind="image", data=np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    prompts = [PromptRequest(prompt_ids=np.array(PROMPTS[0]), media=(image,)), PROMPTS[2]]
    groups = engine.generate(prompts, n=2, max_new_tokens=5, temperature=1.0, seed=0)
    assert groups[0].media == (image,) and groups[1].media == ()
    traj_groups = [
        to_trajectory_group(g, group_id=f"g{i}", source="mm_qa", rewards=[1.0, 0.0], version_start=3, version_end=4)
        for i, g in enumerate(groups)
    ]
    tables = build_unit_tables(traj_groups)
    assert tables.media.num_rows == 1 and tables.media.column("media_hash")[0].as_py() == image.hash
    media_col = tables.traj.column("media").to_pylist()
    assert media_col == [[image.hash], [image.hash], [], []]
    got = tables.traj.column("response_logprobs").to_pylist()
    want = [s.response_logprobs.tolist() for g in groups for s in g.samples]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    assert tables.traj.column("version_end").to_pylist() == [4, 4, 4, 4]


def test_to_trajectory_group_checks_rewards_and_versions(engine: HFEngine) -> None:
    """Reward count and finiteness are checked at once; version order and mask shapes when the unit is built."""
    (g,) = engine.generate([PROMPTS[0]], n=2, max_new_tokens=4, temperature=1.0, seed=0)
    kw = {"group_id": "g", "source": "math", "version_start": 1, "version_end": 1}
    with pytest.raises(InvalidRequest, match="1 rewards for 2 samples"):
        to_trajectory_group(g, rewards=[1.0], **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="finite"):
        to_trajectory_group(g, rewards=[1.0, float("nan")], **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="version_end"):
        build_unit_tables(
            [to_trajectory_group(g, group_id="g", source="math", rewards=[0, 1], version_start=2, version_end=1)]
        )
    with pytest.raises(InvalidRequest, match="loss_mask"):
        build_unit_tables([to_trajectory_group(g, rewards=[0, 1], loss_masks=[np.ones(99), np.ones(99)], **kw)])  # type: ignore[arg-type]


def test_adapter_and_result_types_refuse_what_does_not_fit() -> None:
    """``groups_from_generate_output`` checks rows, score steps and ``n``; the result types check their fields."""
    from knittrans.rollout.adapters.hf import groups_from_generate_output
    from knittrans.rollout.generated import GeneratedSample

    prompts = [PromptRequest(prompt_ids=np.array([1, 2], np.int32))]
    sequences = torch.tensor([[1, 2, 7, EOS], [1, 2, 8, 9]])
    scores = [torch.zeros(2, VOCAB), torch.zeros(2, VOCAB)]
    kw = {"prompt_width": 2, "eos_token_ids": (EOS,)}
    (g,) = groups_from_generate_output(prompts, sequences, scores, n=2, **kw)  # type: ignore[arg-type]
    assert [s.finish_reason for s in g.samples] == ["stop", "length"]
    with pytest.raises(InvalidRequest, match="n must be positive"):
        groups_from_generate_output(prompts, sequences, scores, n=0, **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=r"expected \(3, \.\.\.\)"):
        groups_from_generate_output(prompts, sequences, scores, n=3, **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="do not match 1 steps of scores"):
        groups_from_generate_output(prompts, sequences, scores[:1], n=2, **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="1-D"):
        PromptRequest(prompt_ids=np.ones((2, 2), np.int32))
    with pytest.raises(InvalidRequest, match=r"outside \[0, 2\*\*31\)"):
        PromptRequest(prompt_ids=np.array([-1]))
    with pytest.raises(InvalidRequest, match="must be knittrans"):
        PromptRequest(prompt_ids=np.array([1]), media=(b"png",))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="response_logprobs has shape"):
        GeneratedSample(response_ids=np.array([1, 2]), response_logprobs=np.zeros(1), finish_reason="stop")
    with pytest.raises(InvalidRequest, match="finish_reason"):
        GeneratedSample(response_ids=np.array([1]), response_logprobs=np.zeros(1), finish_reason="abort")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="at least one sample"):
        GeneratedGroup(prompt_ids=np.array([1]), samples=())
