"""Which on-disk versions a version_policy serves."""

from __future__ import annotations

from pier.protocol import model_config_pb2 as mc


def select_versions(policy: mc.ModelVersionPolicy, available: list[int]) -> list[int]:
    """`latest {num_versions}` (default 1): the highest N; `all`: every one; `specific`: the
    listed ones that exist. Sorted ascending."""
    ordered = sorted(available)
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return ordered
    if which == "specific":
        wanted = set(policy.specific.versions)
        return [v for v in ordered if v in wanted]
    n = policy.latest.num_versions if which == "latest" else 1
    return ordered[-max(n, 1):]
