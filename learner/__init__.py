"""learner package."""
