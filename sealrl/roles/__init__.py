"""One file per role (DESIGN section 2). Roles exchange ExperienceBatch objects only."""
