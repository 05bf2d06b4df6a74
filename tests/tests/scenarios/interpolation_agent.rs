//! `${…}` through the real agent: the process gets the substituted command line, and a
//! reference to an unknown variable is a diagnostic at its file, line and column that
//! keeps the last good revision running.

use std::time::Duration;

use crate::agent_support::{AgentDirs, processes_with, unique_nap, wait_for};

const WITHIN: Duration = Duration::from_secs(20);

fn spec(marker: &str, extra_arg: &str) -> String {
    format!(
        r#"apiVersion: stead/v1
kind: Alloc
metadata: {{name: web}}
spec:
  tasks:
    - name: main
      driver: exec
      env:
        PORT: "8080"
        GREETING: "hello ${{STEAD_ALLOC_NAME}}"
        PATH: "/opt/stead-test/bin:${{env.PATH}}"
      config:
        command: /bin/sh
        args:
          - -c
          - "trap 'exit 0' TERM; while :; do sleep 0.2; done"
          - "{marker}"
          - "${{STEAD_TASK_DIR}}/conf"
          - "--port=${{env.PORT}}"
          - "${{env.GREETING}} in ${{STEAD_ALLOC_ID}}/${{STEAD_TASK_NAME}}"
          - "$${{HOME}} stays"
          - "{extra_arg}"
"#
    )
}

#[test]
fn interpolated_arguments_reach_the_process_and_an_unknown_variable_is_a_diagnostic() {
    let dirs = AgentDirs::new("");
    let marker = unique_nap();
    dirs.write_spec("web", &spec(&marker, "${STEAD_SECRETS_DIR}"));
    let agent = dirs.start();
    let task = agent.wait_for_task("web", "web running", WITHIN, |t| t.state == "running");
    let status = agent.status("web").expect("web shown");
    let pid = task.pid.expect("a pid");
    assert_eq!(processes_with(&marker), vec![pid]);
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let task_dir = dirs.data.join("allocs").join(&status.id).join("main");
    assert_eq!(
        args[4..],
        [
            format!("{}/conf", task_dir.display()),
            "--port=8080".to_owned(),
            format!("hello web in {}/main", status.id),
            "${HOME} stays".to_owned(),
            task_dir.join("secrets").display().to_string(),
        ],
        "{args:?}"
    );

    // `alloc exec` sees the environment as the task has it, the PATH extended.
    let (code, out, err) = agent.cli(&[
        "alloc", "exec", "web", "main", "--", "printenv", "GREETING", "PATH",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        "hello web\n/opt/stead-test/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
    );

    // An edit naming an unknown variable is refused where it is written; the running
    // revision stays.
    dirs.write_spec("web", &spec(&marker, "--home=${HOME}"));
    let status = wait_for("the spec error shown", WITHIN, || {
        let status = agent.status("web");
        status
            .clone()
            .filter(|s| s.spec_error.is_some())
            .ok_or_else(|| format!("{status:#?}"))
    });
    let error = status.spec_error.expect("a spec error");
    assert!(
        error.contains("web.yaml:22:13: spec.tasks[0].config.args[7]: unknown variable `${HOME}`"),
        "{error}"
    );
    assert_eq!(
        processes_with(&marker),
        vec![pid],
        "the last good revision runs on"
    );
    assert_eq!(status.tasks["main"].pid, Some(pid));
}
