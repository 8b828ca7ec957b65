"""Draft training: distillation of a draft (EAGLE head or small model) from a target.

:mod:`specjax.train.distill` holds the data generation and caching, losses, the optax
loop, orbax checkpoints and held-out acceptance; ``scripts/train_draft.py`` runs it.
"""
