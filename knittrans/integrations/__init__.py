"""Integrations with the engines and frameworks around KnitTrans; each imports its framework lazily.

* ``ray``           stores and control plane as Ray actors
* ``transferqueue`` TransferQueue storage backend ``KnitTrans`` (codec in ``tqcodec``)
* ``verl``          verl v1 replay-buffer sampler with quota-preserving admission
"""
