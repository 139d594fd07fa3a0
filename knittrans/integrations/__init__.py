"""Integrations with cluster engines that launch KnitTrans processes (Ray); each imports its engine lazily."""
