"""Control plane: a load or unload runs to completion even when its caller gives up."""

from __future__ import annotations

import asyncio

from pier.control.plane import ControlPlane


class SlowManager:
    def __init__(self) -> None:
        self.finished: list[str] = []

    async def load(self, name: str, override: object = None) -> None:
        await asyncio.sleep(0.2)
        self.finished.append(f"load {name}")

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        await asyncio.sleep(0.2)
        self.finished.append(f"unload {name}")


def test_a_cancelled_caller_does_not_stop_the_operation_half_way():
    async def main() -> list[str]:
        manager = SlowManager()
        plane = ControlPlane(manager, "explicit")  # type: ignore[arg-type]
        for op in (plane.load, plane.unload):
            try:
                await asyncio.wait_for(op("m"), 0.05)  # the client disconnects / times out
            except asyncio.TimeoutError:
                pass
            else:
                raise AssertionError("the operation should still have been running")
        await asyncio.sleep(0.4)
        return manager.finished

    assert asyncio.run(main()) == ["load m", "unload m"]
