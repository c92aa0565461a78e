package schema

// MigrationFilesForTest exposes migrationFiles to the external test package.
var MigrationFilesForTest = migrationFiles
