"""SGLang's entry point into this package (group ``sglang.srt.plugins``)."""


def register() -> None:
    """Called by SGLang in each of its processes before it parses arguments."""
    from . import backend

    backend.install()
