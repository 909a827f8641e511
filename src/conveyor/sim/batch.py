"""What a cost model sees of one step (defined in the core: the budget controller uses it)."""

from conveyor.core.batch_shape import BatchShape, batch_shape

__all__ = ["BatchShape", "batch_shape"]
