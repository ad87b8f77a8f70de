"""raymoe: serve Mixture-of-Experts LLM checkpoints with expert parallelism on Ray.

The source tree keeps the design card's top-level folders; each is a subpackage here:
``raymoe.moe`` (moe/), ``raymoe.kernels`` (kernels/), ``raymoe.engine`` (engine/),
``raymoe.actors`` (actors/), ``raymoe.cluster`` (cluster/), ``raymoe.configs`` (configs/).

Glossary
--------
logical expert
    Expert ``e`` of an MoE layer as the checkpoint defines it (``0 <= e < E``).
physical slot
    A place that holds one copy of one logical expert's weights. Slots are numbered
    globally per layer; worker ``w`` owns slots ``[w * S, (w + 1) * S)``.
replica
    A logical expert held by more than one slot. Any replica computes the same function.
worker
    One expert-parallel rank (a Ray actor pinned to one GPU, or a CPU slot).
epoch
    Version of a :class:`raymoe.moe.placement.PlacementTable`; it only ever grows.
assignment
    One (token, logical expert) pair chosen by the gate; a step has ``T * k`` of them.
"""

__version__ = "0.1.0"
