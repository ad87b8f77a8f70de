"""Compute and communication primitives: grouped expert MLP, attention, communicators."""
