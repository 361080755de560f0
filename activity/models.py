"""The activity log's models arrive with the activity-log issue."""
