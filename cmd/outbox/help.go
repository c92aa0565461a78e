package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
)

// helpVar is one environment variable in a command's help: name, default,
// meaning.
type helpVar [3]string

// databaseURLVar is the variable every command that reads the database
// names in its help.
var databaseURLVar = helpVar{"OUTBOX_DATABASE_URL", "(required)", "PostgreSQL URL or DSN of the database that holds the table, e.g. postgres://user:password@host:5432/db"}

// helpText is the help a command prints for -h or --help: run prints it on
// stdout and exits 0. It matches flag.ErrHelp.
type helpText struct{ text string }

func (h *helpText) Error() string { return "help requested" }

// Is makes errors.Is(err, flag.ErrHelp) true.
func (h *helpText) Is(target error) bool { return target == flag.ErrHelp }

// writeHelp renders a command's help: its usage line, an optional
// description, its flags (fs may be nil) and the environment it reads,
// OUTBOX_DATABASE_URL first.
func writeHelp(w io.Writer, synopsis, about string, fs *flag.FlagSet, vars ...helpVar) {
	fmt.Fprintf(w, "usage: %s\n", synopsis)
	if about != "" {
		fmt.Fprintf(w, "\n%s\n", about)
	}
	if fs != nil {
		fmt.Fprintln(w, "\nflags:")
		out := fs.Output()
		fs.SetOutput(w)
		fs.PrintDefaults()
		fs.SetOutput(out)
	}
	fmt.Fprintln(w, "\nenvironment:")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, v := range append([]helpVar{databaseURLVar}, vars...) {
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", v[0], v[1], v[2])
	}
	_ = tw.Flush()
}

// helpFor returns the *helpText of writeHelp's output.
func helpFor(synopsis, about string, fs *flag.FlagSet, vars ...helpVar) error {
	var b bytes.Buffer
	writeHelp(&b, synopsis, about, fs, vars...)
	return &helpText{text: b.String()}
}

// isHelpArg reports whether arg asks for help where a subcommand is
// expected.
func isHelpArg(arg string) bool {
	switch arg {
	case "-h", "-help", "--h", "--help", "help":
		return true
	}
	return false
}

// parseFlags parses args into fs. -h or --help returns the command's help
// (a *helpText, printed by run on stdout); a bad flag is a usage error
// that points at the help.
func parseFlags(fs *flag.FlagSet, args []string, synopsis string, vars ...helpVar) error {
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	err := fs.Parse(args)
	if errors.Is(err, flag.ErrHelp) {
		return helpFor(synopsis, "", fs, vars...)
	}
	if err != nil {
		return fmt.Errorf("%w: %w (see `outbox %s --help`)", errUsage, err, fs.Name())
	}
	return nil
}
