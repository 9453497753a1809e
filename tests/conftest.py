"""Shared test settings: hypothesis profile sized for a 2-core CPU machine."""

from hypothesis import settings

settings.register_profile("cem", max_examples=5, deadline=None, derandomize=True)
settings.load_profile("cem")
