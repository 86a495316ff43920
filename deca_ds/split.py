"""deca-split (also `python -m deca_ds.split`): write the split a run would make as each client's own
training file. The command is deca_ds.runtime.split's; it loads only when called."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from .runtime.split import main as split_main

    split_main(argv)


if __name__ == "__main__":
    main()
