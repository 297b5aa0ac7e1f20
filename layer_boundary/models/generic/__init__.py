"""The Transformers backend: any transformers decoder whose config states how its linears
split (``base_model_tp_plan``), built from transformers' own modules and run on the layer
boundaries.

A checkpoint without a model file of ours (or any checkpoint, with ``--model-impl
transformers``) is served by ``GenericCausalLM``: transformers' classes are built on the meta
device, each linear the tp_plan names becomes our parallel linear of that style (a row-parallel
one leaves its sum owed to the boundary), each decoder layer is cut into an attention and an
FFN stage whose norms become the boundaries' reads and updates, and attention runs through a
function registered with transformers' ``AttentionInterface`` over our KV cache. Before any
rank starts, ``probe.check`` runs a small copy of the model at world 1 through this path and
through transformers' own forward; a difference beyond fp32 rounding refuses it by name.

transformers is an optional dependency (the ``transformers`` extra): nothing here imports it
until a checkpoint asks for this path. Files: ``config.py`` (what is read and refused),
``build.py`` (modules on the meta device, linears swapped), ``attention.py`` (the attention
function and rotary tables), ``model.py`` (the layer and the model), ``probe.py``.
"""
