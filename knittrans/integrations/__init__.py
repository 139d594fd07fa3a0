"""Integrations with the engines and frameworks around KnitTrans; each imports its framework lazily."""
