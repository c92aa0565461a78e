package runbook

// RowRulesTable is rowRulesTable, for the external tests.
var RowRulesTable = rowRulesTable
