"""Scale-out on torch.distributed: a rank's place in its tensor-parallel group, the collectives
the model's layers call (gloo on CPU, NCCL on CUDA), and the scheduler ranks' broadcast of what
rank 0 receives. Imports nothing of Baton's above the config."""
