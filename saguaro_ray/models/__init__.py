"""Models made for a target: drafts distilled from it."""
