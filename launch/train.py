"""Decentralized fine-tuning with DECA: `deepspeed [--num_gpus K | --hostfile H] launch/train.py
--config run.yaml` (or --preset NAME, or --ds_config ds_configs/<preset>.json; also under torchrun).
The same as the deca-train command; `--help` lists the options."""

from deca_ds.train import main

if __name__ == "__main__":
    main()
