"""OpenCLIP's own loss module, for side-by-side tests.

``import open_clip`` needs torchvision, whose only offline wheel for this CPU torch is a CUDA build
that cannot load; ``open_clip/loss.py`` itself needs only torch, so it is executed from its file
in the installed package. ``None`` when open_clip_torch is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def openclip_loss_module():
    """OpenCLIP's ``loss`` module (``ClipLoss``, ``SigLipLoss``), or ``None`` if not installed."""
    name = "_open_clip_loss_file"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "loss.py")
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
