"""tfps.runtime: what PS and worker pods run. Imports neither kopf nor kubernetes."""
