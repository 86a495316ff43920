"""Decentralized fine-tuning with DECA: `deepspeed [--num_gpus K | --hostfile H] launch/train.py
--ds_config ds_configs/<preset>.json [options]` (or under torchrun). `--help` lists the options."""

from deca_ds.runtime.trainer import main

if __name__ == "__main__":
    main()
