"""The in-process engine: checkpoint loading, the dense model, KV cache, scheduler, sampler.

It is the reference for the distributed engine: routers run this same loop with a remote
expert backend in place of :class:`raymoe.engine.experts.LocalExperts`.
"""
