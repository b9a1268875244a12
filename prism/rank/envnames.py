"""Environment variables a shell sets for a sandbox rank, importable without
torch (the rest of ``prism.rank`` imports it): the emulating coordinator
needs their names, not torch's two seconds and 150 MB."""

#: The emulation's sandbox ranks, comma-separated (``prism.rank.devicepath``).
SANDBOX_ENV = "PRISM_SANDBOX_RANKS"
#: "1": a GPU sandbox keeps calls answered by virtual ranks only on its device.
GPU_SANDBOX_ENV = "PRISM_GPU_SANDBOX"
#: Comma-separated physical GPUs shared by the run (``prism.rank.devices``).
GPUS_ENV = "PRISM_GPUS"
