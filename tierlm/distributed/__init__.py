"""Running one model across several processes: pipeline stages over torch.distributed."""
