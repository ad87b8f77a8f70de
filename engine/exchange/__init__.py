"""The expert-parallel exchange: how a router's tokens reach the expert workers of its group
and come back, one MoE layer at a time (ep_exchange), and the router's view of the remote
experts as one module of the model (remote_experts)."""
