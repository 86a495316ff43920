"""deca-eval (also `python -m deca_ds.eval`): evaluate an exported model, e.g. <output>/consensus.
The command is deca_ds.runtime.evaluate's; it loads only when called, so importing this is cheap."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from .runtime.evaluate import main as evaluate_main

    evaluate_main(argv)


if __name__ == "__main__":
    main()
