"""shardplan: plan, estimate and run distributed training jobs."""

__version__ = "0.1.0"
