"""Choosing replicas: pure policies (`policy`, `prefix_index`, `loads`) and the Ray Serve request
routers that apply them (`serve_routers`, imported only by the Serve handles that use it)."""

from router.routing.policy import DecodeLoadPolicy, PrefixAwarePolicy
from router.routing.prefix_index import PrefixIndex

__all__ = ["DecodeLoadPolicy", "PrefixAwarePolicy", "PrefixIndex"]
