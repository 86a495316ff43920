"""The distributed runtime: DeepSpeed engines, one process group per client, neighbor mixing over
torch.distributed, checkpoints, metrics and export. The algorithm itself lives one level up and
imports nothing from here."""
