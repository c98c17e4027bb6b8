"""Bad weights: a checkpoint holding a NaN or an Inf is a CheckpointError naming the tensor
(unless the check is skipped), and a step whose logits are not finite raises instead of sampling."""

import pytest
import torch

from helpers import random_ids, random_model
from shram_static import CheckpointError, NonFiniteLogitsError, ShramForCausalLM, StaticDecoder


@pytest.fixture(scope="module")
def model():
    return random_model(5, num_decoder_layers=1)


def _poisoned(model, key: str, value: float):
    """A copy of `model` whose tensor `key` holds `value` at one element."""
    bad = ShramForCausalLM(model.config)
    bad.load_state_dict(model.state_dict())
    with torch.no_grad():
        dict(bad.named_parameters())[key].view(-1)[3] = value
    return bad.eval()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_checkpoint_with_a_non_finite_weight_is_refused_by_name(model, tmp_path, value):
    key = next(k for k in dict(model.named_parameters()) if k.endswith("mlp.up_proj.weight")
               or "proj" in k)
    _poisoned(model, key, value).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")) as e:
        ShramForCausalLM.from_pretrained(tmp_path)
    assert "check_finite=False" in str(e.value)
    loaded = ShramForCausalLM.from_pretrained(tmp_path, check_finite=False)  # explicit opt-out
    assert not torch.isfinite(dict(loaded.named_parameters())[key]).all()
    with pytest.raises(TypeError, match="check_finite"):
        ShramForCausalLM.from_pretrained(tmp_path, check_finite="no")


def test_clean_checkpoint_loads(model, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = ShramForCausalLM.from_pretrained(tmp_path)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k


def test_non_finite_logits_raise_instead_of_sampling(model):
    bad = _poisoned(model, "lm_head.weight" if model.lm_head is not None else "embed_tokens.weight",
                    float("nan"))
    ids = random_ids(model.config, 1, 6, seed=1)
    dec = StaticDecoder(bad, batch_size=1, prefill_chunk=4)
    with pytest.raises(NonFiniteLogitsError, match="NaN or Inf logits"):
        dec.generate(ids, max_new_tokens=3)
    dec.reset()
    with pytest.raises(NonFiniteLogitsError):
        dec.prefill(ids)
    dec.reset()
    with pytest.raises(NonFiniteLogitsError):
        dec.decode(ids[:, 0])
    assert dec.live_counts.tolist() == [1]  # the step ran: its token is held, and counted
    good = StaticDecoder(model, batch_size=1, prefill_chunk=4)  # the same calls pass on clean weights
    assert good.generate(ids, max_new_tokens=3).shape == (1, 3)


@pytest.mark.parametrize("V", [50, 300])  # 200 logits, summed in Python; 1200, by numpy (`FEW_LOGITS`)
def test_finite_check_looks_past_a_sum_that_overflows_and_at_live_tokens_only(V):
    """The logits check sums first: a sum that overflows (every value finite) must not raise,
    a NaN or an Inf at a live token must (naming its row, in any float dtype), one at a dead
    token must not."""
    from shram_static.host import FEW_LOGITS, _check_finite

    assert (4 * V <= FEW_LOGITS) == (V == 50)
    live = torch.tensor([[True, False], [True, True]])
    big = torch.full((2, 2, V), 3e38)
    big[1, 1, ::2] = -3e38
    _check_finite(big, live)  # the sum overflows, every value is finite
    for dtype in (torch.float32, torch.bfloat16):
        for bad in (float("nan"), float("inf"), -float("inf")):
            lg = torch.randn(2, 2, V).to(dtype)
            lg[0, 1, 7] = bad  # a dead token
            _check_finite(lg, live)
            lg[1, 0, V - 1] = bad
            with pytest.raises(NonFiniteLogitsError, match=r"rows \[1\]"):
                _check_finite(lg, live)
