"""ds_infcl.settings: the one table of DS_INFCL_* environment settings and its readers."""

import os
import sys
import types
import zlib

import pytest

from ds_infcl import settings


def test_every_declaration_is_complete():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names)) and all(n.startswith(settings.PREFIX) for n in names)
    sections = {key for key, _, _ in settings.SECTIONS}
    for s in settings.SETTINGS:
        assert s.kind in ("int", "choice", "flag", "seconds", "text"), s
        assert s.read in ("import", "call") and s.ranks in ("must match", "may differ") and s.section in sections, s
        assert s.doc, s
        if s.kind == "choice":
            assert s.default in s.choices, s
        if s.read == "import":  # its module attribute holds the value (current(), the fingerprint)
            module, attr = s.home.split(":")
            assert module.startswith("ds_infcl.") and attr, s
        # the default is what an unset variable reads as
        assert settings.get(s.name) == s.default or os.environ.get(s.name) is not None


@pytest.mark.parametrize("name, text, message", [
    ("DS_INFCL_GATHER_MAX_LOCAL", "-1", "DS_INFCL_GATHER_MAX_LOCAL must be an integer >= 0, got '-1'"),
    ("DS_INFCL_CUDA_GRAPH_MAX_LOGITS", "8k", "DS_INFCL_CUDA_GRAPH_MAX_LOGITS must be a positive integer, got '8k'"),
    ("DS_INFCL_CUDA_GRAPH_MAX_LOGITS", "0", "DS_INFCL_CUDA_GRAPH_MAX_LOGITS must be a positive integer, got '0'"),
    ("DS_INFCL_ALGORITHM", "fast", "DS_INFCL_ALGORITHM must be auto, ring or gather, got 'fast'"),
    ("DS_INFCL_GLUON", "yes", "DS_INFCL_GLUON must be auto, 0 or 1, got 'yes'"),
    ("DS_INFCL_PEER_COPY", "", "DS_INFCL_PEER_COPY must be 0 or 1, got ''"),
    ("DS_INFCL_ALLOW_TF32", "true", "DS_INFCL_ALLOW_TF32 must be '1' (on) or '0' (off), got 'true'"),
    ("DS_INFCL_LAYOUT_SHM_TIMEOUT", "-3", "DS_INFCL_LAYOUT_SHM_TIMEOUT must be a number of seconds > 0, got '-3'"),
])
def test_a_bad_value_names_the_variable_and_what_it_takes(monkeypatch, name, text, message):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError) as err:
        settings.get(name)
    assert str(err.value) == message


@pytest.mark.parametrize("name, text, value", [
    ("DS_INFCL_GATHER_MAX_LOCAL", "0", 0),
    ("DS_INFCL_CUDA_GRAPH_MAX_LOGITS", "4096", 4096),
    ("DS_INFCL_ALGORITHM", "ring", "ring"),
    ("DS_INFCL_ALLOW_TF32", "1", True),
    ("DS_INFCL_TRITON_EXACT_MUL", "0", False),
    ("DS_INFCL_LAYOUT_SHM_TIMEOUT", "2.5", 2.5),
    ("DS_INFCL_TRITON_CHUNK", "64x32", "64x32"),
    ("DS_INFCL_TRITON_CHUNK", "", None),  # empty: unset
])
def test_values_are_parsed_per_call(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert settings.get(name) == value


def test_an_undeclared_name_is_an_error():
    with pytest.raises(KeyError, match="'DS_INFCL_NOPE' is not a declared setting; add it to ds_infcl/settings.py"):
        settings.get("DS_INFCL_NOPE")


def test_override_checks_sets_and_restores(monkeypatch):
    monkeypatch.setenv("DS_INFCL_ALGORITHM", "gather")
    with settings.override("DS_INFCL_ALGORITHM", "ring"):
        assert os.environ["DS_INFCL_ALGORITHM"] == "ring" and settings.get("DS_INFCL_ALGORITHM") == "ring"
        with settings.override("DS_INFCL_ALGORITHM", None):
            assert "DS_INFCL_ALGORITHM" not in os.environ
        assert os.environ["DS_INFCL_ALGORITHM"] == "ring"
    assert os.environ["DS_INFCL_ALGORITHM"] == "gather"
    with pytest.raises(ValueError, match="DS_INFCL_ALGORITHM must be auto, ring or gather, got 'fast'"):
        with settings.override("DS_INFCL_ALGORITHM", "fast"):
            pass
    assert os.environ["DS_INFCL_ALGORITHM"] == "gather"
    monkeypatch.delenv("DS_INFCL_ALLOW_TF32", raising=False)
    with settings.override("DS_INFCL_ALLOW_TF32", True):
        assert os.environ["DS_INFCL_ALLOW_TF32"] == "1"
    assert "DS_INFCL_ALLOW_TF32" not in os.environ
    settings.put("DS_INFCL_ALLOW_TF32", False)
    assert os.environ["DS_INFCL_ALLOW_TF32"] == "0"
    settings.put("DS_INFCL_ALLOW_TF32", None)
    assert "DS_INFCL_ALLOW_TF32" not in os.environ


def test_current_reads_the_module_attribute_of_an_import_time_setting(monkeypatch):
    module = types.ModuleType("ds_infcl.loss.ring_steps")
    module.RING_OVERLAP = "0"
    monkeypatch.setitem(sys.modules, "ds_infcl.loss.ring_steps", module)
    monkeypatch.setenv("DS_INFCL_RING_OVERLAP", "1")
    assert settings.current("DS_INFCL_RING_OVERLAP") == "0"  # what the module read (or was set to)
    monkeypatch.delitem(sys.modules, "ds_infcl.loss.ring_steps")
    assert settings.current("DS_INFCL_RING_OVERLAP") == "1"  # not loaded: what it would read
    monkeypatch.setenv("DS_INFCL_ALGORITHM", "gather")  # read per call: the environment
    assert settings.current("DS_INFCL_ALGORITHM") == "gather"


def _expected_fingerprint():
    """The fingerprint by hand: each "must match" setting's value, in the table's order."""
    values = []
    for s in settings.SETTINGS:
        if s.ranks != "must match":
            continue
        if s.read == "import":
            module, attr = s.home.split(":")
            values.append(getattr(sys.modules[module], attr))
        else:
            values.append(os.environ.get(s.name, s.default))
    return zlib.crc32("|".join(map(str, values)).encode())


def test_the_fingerprint_covers_the_must_match_settings_only(monkeypatch):
    import ds_infcl.loss.ring  # noqa: F401 (loads every module that holds a must-match setting)
    from ds_infcl.loss import algorithm, peer_copy, ring_fused, ring_steps

    assert set(settings.must_match()) == {
        "DS_INFCL_ALGORITHM", "DS_INFCL_GATHER_MAX_LOCAL", "DS_INFCL_GATHER_MAX_BYTES", "DS_INFCL_RING_OVERLAP",
        "DS_INFCL_RING_OVERLAP_MAX_ROWS", "DS_INFCL_PEER_COPY", "DS_INFCL_PEER_COPY_MIN_ROWS",
        "DS_INFCL_GATHER_OWN_BACKWARD_MIN_LOGITS"}
    monkeypatch.delenv("DS_INFCL_ALGORITHM", raising=False)
    base = algorithm.algorithm_settings()
    assert base == settings.fingerprint() == _expected_fingerprint()
    changes = [(algorithm, "GATHER_MAX_LOCAL", 7), (algorithm, "GATHER_MAX_BYTES", 7),
               (algorithm, "GATHER_OWN_BACKWARD_MIN_LOGITS", 7), (ring_steps, "RING_OVERLAP", "1"),
               (ring_steps, "RING_OVERLAP_MAX_ROWS", 7), (peer_copy, "PEER_COPY", "1"),
               (peer_copy, "PEER_COPY_MIN_ROWS", 7)]
    for module, attr, value in changes:
        with monkeypatch.context() as m:
            m.setattr(module, attr, value)
            assert algorithm.algorithm_settings() != base, attr
            assert algorithm.algorithm_settings() == _expected_fingerprint()
    with monkeypatch.context() as m:
        m.setenv("DS_INFCL_ALGORITHM", "ring")
        assert algorithm.algorithm_settings() != base
        m.setenv("DS_INFCL_ALGORITHM", "auto")
        assert algorithm.algorithm_settings() == base  # unset reads as auto
        m.setenv("DS_INFCL_ALGORITHM", "fast")  # per call, as written: raises where it is used, not here
        assert algorithm.algorithm_settings() != base
    with monkeypatch.context() as m:  # a setting the ranks may differ on is not in it
        m.setattr(ring_fused, "EARLY_MIN_LOGITS", 7)
        m.setenv("DS_INFCL_GLUON", "0")
        assert algorithm.algorithm_settings() == base


def test_warn_once_warns_once_per_key(monkeypatch):
    monkeypatch.setattr(settings, "_WARNED", set())
    with pytest.warns(settings.FastPathWarning, match="the reason"):
        assert settings.warn_once("k", "the reason")
    assert issubclass(settings.FastPathWarning, RuntimeWarning)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not settings.warn_once("k", "the reason again")


def test_the_settings_module_lists_the_values_in_this_environment(monkeypatch, capsys):
    monkeypatch.setenv("DS_INFCL_ALGORITHM", "ring")
    monkeypatch.setenv("DS_INFCL_GLUON", "maybe")
    assert settings.main([]) == 0
    out = capsys.readouterr().out
    assert "DS_INFCL_ALGORITHM" in out and "'ring'" in out
    assert "error: DS_INFCL_GLUON must be auto, 0 or 1, got 'maybe'" in out
