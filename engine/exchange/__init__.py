"""The expert-parallel exchange: how a router's tokens reach the expert workers of its group
and come back, one MoE layer at a time, and the router's view of the remote experts as one
module of the model (remote_experts). ep_exchange picks each side's implementation once, when a
rank joins the group: sides (the interface, and what both share), python_sides (every message
through the communicator), native_sides (each layer in one native call). What travels on the
wire is kernels/comm/wire.py's."""
