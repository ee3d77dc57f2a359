"""Drop-in classes for users of other checkpointing clients (torch-free until a submodule is
imported): :mod:`tierckpt_client.compat.sagemaker`."""
