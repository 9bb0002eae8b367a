"""`shardplan run`: execute a plan with PyTorch. Modules here import torch, except
`capabilities`, which the CLI consults before anything starts."""
