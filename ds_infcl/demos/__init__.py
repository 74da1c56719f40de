"""Built-in demos: each runs a whole job on data that ships with the package or its dependencies.

- ``trainer``: the 2-rank CPU run of the trainer behind ``make demo`` (CLIP on the scikit-learn
  digits, or the synthetic task), through the ``deepspeed`` launcher.
- ``retrieval``: dense retrieval fine-tuning on the chatterbot corpus (``make demo-retrieval``).
- ``clip_digits_check``: the same digits CLIP model trained without DeepSpeed, as a cross-check.
- ``loss``: the loss alone against the materialized reference (``make demo-loss``).

Demos may import tasks, the engine and adapters; nothing imports a demo.
"""
