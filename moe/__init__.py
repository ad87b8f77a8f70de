"""Pure MoE math and plans: model configs, gating, dispatch plans, capacity, placement.

Nothing here imports Ray or touches a device other than through torch/numpy tensors.
"""
