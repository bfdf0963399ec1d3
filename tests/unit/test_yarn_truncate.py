"""YaRN's frequencies equal transformers' where the ramp's ends fall between channels (original
context 4,096, head dims 64 and 128, as released configs have them), for both ``truncate`` values:
rounding the ends outwards (DeepSeek-V3) or not (gpt-oss) changes the frequencies there, so a
rounding inverted or ignored fails here. (The tiny families' configs put the ends on whole channels,
where rounding changes nothing.)"""

import pytest
import torch

from lightning_titan.model.yarn import inv_freq_and_factor


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("head_dim, theta, factor", [(64, 150_000.0, 32.0), (128, 10_000.0, 40.0)])
def test_yarn_frequencies_equal_transformers_for_both_truncate_values(
    head_dim, theta, factor, truncate
):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = {
        "factor": factor, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": truncate,
    }  # fmt: skip
    config = transformers.GptOssConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=int(factor * 4096),
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, **yarn},
    )  # fmt: skip
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    ours, our_factor = inv_freq_and_factor(head_dim, theta, yarn)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(their_factor, rel=1e-12)
    # the case matters: the other rounding gives other frequencies
    other, _ = inv_freq_and_factor(head_dim, theta, {**yarn, "truncate": not truncate})
    assert (other - theirs.float()).abs().max() > 1e-4
