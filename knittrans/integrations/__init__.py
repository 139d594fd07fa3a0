"""Integrations with the engines and frameworks around KnitTrans; each imports its framework lazily.

* ``ray``           stores and control plane as Ray actors
* ``transferqueue`` TransferQueue storage backend ``KnitTrans`` (storage logic ``tqstore``, codec ``tqcodec`` /
  ``tqrows``, ``tqcheckpoint``, ``tqbootstrap``)
* ``areal``         AReaL ``RTensorBackend`` over KnitTrans units
* ``verl``          verl v1 replay-buffer sampler with quota-preserving admission
"""
