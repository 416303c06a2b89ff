"""Scale-out over many engines on Ray (``distributed.ray``), and vLLM's
``cleanup_dist_env_and_memory``."""
import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's clean-up between engines: dropped engines free their workers and cache; live ones
    keep running."""
    if shutdown_ray:
        import ray
        ray.shutdown()
    gc.collect()
    import torch
    torch.cuda.empty_cache()  # a no-op while CUDA is uninitialized
