"""Train the small Llama the scaled reproduction fine-tunes: `python launch/pretrain.py --output-dir
runs/pretrained/synthetic [--dataset agnews --data-files train=… test=…]`, the same as the
deca-pretrain command (deca_ds.reproduce.pretrain)."""

from deca_ds.reproduce.pretrain import main

if __name__ == "__main__":
    main()
