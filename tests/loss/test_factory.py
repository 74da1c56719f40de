"""One factory from a loss name to its module (``ds_infcl.loss.build_loss``): every implementation
registered once where it is defined; the task's defaults under the config's settings."""

import math

import pytest
import torch

from ds_infcl.errors import ConfigError
from ds_infcl.loss import (
    ContrastiveLoss, FastCLIPLoss, SigLIPLoss, available_fastclip_losses, available_loss_impls,
    available_loss_modules, build_fastclip_loss, build_loss, check_loss, register_loss_module,
)
from ds_infcl.loss.retrieval import RetrievalLoss


def test_every_name_is_registered_once_and_buildable():
    functional = {"infcl", "vanilla", "local", "disco"}
    assert set(available_loss_impls()) == functional
    assert set(available_loss_modules()) == functional | set(available_fastclip_losses()) | {"siglip", "retrieval"}
    assert set(available_fastclip_losses()) == {"fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3",
                                               "sogclr", "isogclr"}
    with pytest.raises(ValueError, match="'siglip' is already registered"):
        register_loss_module("siglip", lambda settings: None)
    with pytest.raises(ValueError, match=r"unknown loss implementation 'nope'; choose one of \['disco', "):
        build_loss("nope")


@pytest.mark.parametrize("impl", ["infcl", "vanilla", "local", "disco"])
def test_functional_impls_are_contrastive_losses_with_the_config_over_the_defaults(impl):
    defaults = {"symmetric": True, "init_logit_scale": math.log(10.0), "learnable_scale": True}
    loss = build_loss(impl, defaults=defaults, backend="torch", symmetric=False, init_logit_scale=None)
    reference = ContrastiveLoss(impl=impl, backend="torch", symmetric=False, init_logit_scale=math.log(10.0))
    assert isinstance(loss, ContrastiveLoss) and loss.impl == impl and loss.symmetric is False
    assert isinstance(loss.logit_scale, torch.nn.Parameter)
    q, k = torch.randn(6, 8), torch.randn(6, 8)
    torch.testing.assert_close(loss(q, k), reference(q, k))
    with pytest.raises(ConfigError, match=r"loss.matryoshka_dims: task 'mine' does not support it"):
        build_loss(impl, owner="mine", matryoshka_dims=[4])


def test_siglip_ignores_the_infonce_defaults():
    loss = build_loss("siglip", defaults={"symmetric": True, "init_logit_scale": 3.0}, init_logit_bias=-3.0,
                      learnable_scale=False, backend="torch")
    assert isinstance(loss, SigLIPLoss)
    assert loss.logit_scale.item() == pytest.approx(math.log(10.0)) and loss.logit_bias.item() == -3.0
    assert not isinstance(loss.logit_bias, torch.nn.Parameter)


def test_fastclip_tables_sized_from_the_task_or_the_config():
    loss = build_loss("sogclr", sample_index_bound=lambda: 40, backend="torch", args={"gamma": 0.5})
    reference = build_fastclip_loss("sogclr", num_samples=40, backend="torch", gamma=0.5)
    assert isinstance(loss, FastCLIPLoss) and loss.num_samples == 40 and loss.extra_repr() == reference.extra_repr()
    assert loss.current_gamma() == reference.current_gamma() == 0.5
    assert build_loss("fastclip_v3", sample_index_bound=lambda: None, args={"num_samples": 7}).num_samples == 7
    with pytest.raises(ConfigError, match=r"task 'stream' cannot tell how many there are"):
        check_loss("fastclip_v3", owner="stream", sample_index_bound=lambda: None)
    with pytest.raises(ConfigError, match=r"30 is too small .* up to 39 .* set loss.args.num_samples to 40"):
        check_loss("fastclip_v1", sample_index_bound=lambda: 40, args={"num_samples": 30})
    check_loss("infcl")  # nothing to check, nothing built


def test_retrieval_module_from_defaults_and_config():
    loss = build_loss("retrieval", defaults={"scale": 20.0, "symmetric": False, "mask_false_negatives": False},
                      init_logit_scale=math.log(5.0), symmetric=True, backend="torch")
    assert isinstance(loss, RetrievalLoss) and loss.symmetric and not loss.mask_false_negatives
    assert loss.scale.item() == pytest.approx(5.0)


def test_features_not_names_decide_what_a_loss_takes(monkeypatch):
    # The run config's checks and the tasks ask the registry for a loss's features: a loss
    # registered with a feature is treated like the built-in one that has it, named nowhere else.
    from ds_infcl.loss import loss_features, losses_with, registry
    from ds_infcl.train.config import ConfigError, run_config_from_dict

    assert {"logit_bias", "multi_positive"} <= loss_features("siglip") and "directed" not in loss_features("siglip")
    assert losses_with("retrieval") == ("infcl",) and "run_config" not in loss_features("retrieval")
    with pytest.raises(ValueError, match="unknown loss feature 'bias'"):
        losses_with("bias")
    with pytest.raises(ValueError, match="unknown features \\['fast'\\]"):
        registry.register_loss_module("fast_one", lambda s: None, features=("fast",))
    base = {"batch": {"global_batch_size": 8}, "train": {"num_steps": 1}}
    with pytest.raises(ConfigError, match="loss.init_logit_bias: only used by loss.impl 'siglip'; loss.impl is 'infcl'"):
        run_config_from_dict({**base, "loss": {"impl": "infcl", "init_logit_bias": -10.0}})
    monkeypatch.setitem(registry._BUILDERS, "mine", (lambda settings: None, None))
    monkeypatch.setitem(registry._FEATURES, "mine", frozenset({"logit_bias", "run_config"}))
    cfg = run_config_from_dict({**base, "loss": {"impl": "mine", "init_logit_bias": -10.0}})
    assert cfg.loss.impl == "mine"
    with pytest.raises(ConfigError, match="only used by loss.impl 'mine' or 'siglip'"):
        run_config_from_dict({**base, "loss": {"impl": "infcl", "init_logit_bias": -10.0}})
    with pytest.raises(ConfigError, match="loss.symmetric: not used by loss.impl 'mine'"):
        run_config_from_dict({**base, "loss": {"impl": "mine", "symmetric": True}})
