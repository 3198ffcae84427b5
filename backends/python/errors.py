"""The python backend's exception, as Triton's pb_utils defines it (pb_utils re-exports it)."""


class TritonModelException(Exception):
    """Raised by pb_utils calls that fail (e.g. a BLS request to an unknown model)."""

    def message(self) -> str:
        return str(self)
