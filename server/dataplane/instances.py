"""What the frontends ask of every instance of a model at once, beside inference: its load for
inference gateways (ORCA), forgetting cached prefixes (vLLM's /reset_prefix_cache), and loading or
unloading LoRA adapters (vLLM's /v1/load_lora_adapter). The data plane (plane.py) has these through
this mixin; they read only its routing table."""

from __future__ import annotations

from pier.lifecycle.routing import RoutingTable


class InstanceOperations:
    """Operations over the instances of the loaded models in `_routes`."""

    _routes: RoutingTable

    def load_report(self, name: str) -> dict[str, float]:
        """Model `name`'s load now (ORCA's named metrics, for inference gateways): requests waiting
        (its schedulers' queues and what its instances report waiting) and what its instances
        report beside (the LLM's kv_cache_usage_perc: the fullest instance's); {} for no such model."""
        models = [m for m in self._routes.loaded_models() if m.spec.name == name]
        if not models:
            return {}
        report = {"num_requests_waiting": float(sum(m.scheduler.pending_count() for m in models))}
        for m in models:
            for instance in m.instances:
                for key, value in instance.load_report().items():
                    report[key] = report.get(key, 0.0) + value if key == "num_requests_waiting" \
                        else max(value, report.get(key, value))
        return report

    async def reset_prefix_cache(self) -> bool:
        """Every loaded model forgets its cached prefixes (vLLM's /reset_prefix_cache); False if
        one could not now (its requests hold cached blocks)."""
        done = [await instance.reset_prefix_cache() for m in self._routes.loaded_models() for instance in m.instances]
        return all(done)

    async def update_lora(self, model: str, name: str, path: str | None, inplace: bool) -> tuple[int, str]:
        """Load or unload LoRA adapter `name` in every instance of `model`: (HTTP status, text), the first failure's."""
        models = [m for m in self._routes.loaded_models() if m.spec.name == model]
        answers = [await i.update_lora(name, path, inplace) for m in models for i in m.instances]
        return next((a for a in answers if a[0] != 200), answers[0] if answers else (404, f"no model {model!r}"))
