"""tfps.operator: the kopf operator for TrainingJobs (thin handlers, pure builders)."""
