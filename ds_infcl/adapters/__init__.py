"""Task glue: CLIP towers (``ds_infcl.adapters.clip``), retrieval encoders, sentence-transformers
loss classes. Imports the loss's public API, torch and transformers; submodules are imported by
their users (``from ds_infcl.adapters.clip import ClipModel``) so that no optional dependency is
pulled in by the package itself."""
